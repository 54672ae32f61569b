"""Bad input ends in a ``ValueError`` naming the argument (or argparse's exit code 2), never
in a traceback from deep inside or a silent wrong answer (issue 12's table, row by row;
the ``grade`` rows are tested in tests/grading/test_grade.py)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.cli import dumps_json, main
from minipaged.config import EngineConfig

FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


# ------------------------------------------------------------ SamplingParams alone
@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_rejected_in_every_float(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), True])
def test_length_penalty_must_be_finite(value):
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(length_penalty=value)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(stop_token_ids="\n"), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=[2.0]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(n=True), "n"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(top_k=False), "top_k"),
        (dict(seed=True), "seed"),
        (dict(min_tokens=True), "min_tokens"),
        (dict(logprobs=True), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(temperature=True), "temperature"),
        (dict(temperature="0.5"), "temperature"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop=b"x"), "stop"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
    ],
)
def test_bad_sampling_params_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_good_params_are_normalized():
    p = SamplingParams(stop=" a", stop_token_ids=(3, 4))
    assert p.stop == [" a"] and p.stop_token_ids == [3, 4]
    assert BeamSearchParams(early_stopping="never").early_stopping == "never"
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(early_stopping=0)


# ------------------------------------------------------------ LLM construction
@pytest.mark.parametrize("kwargs", [dict(num_blocks=10**9), dict(kv_cache_memory=2**60)])
def test_cache_larger_than_memory_is_refused_before_allocating(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"{name}=.*KV cache needs .* bytes\).* available"):
        LLM(**kwargs)


def test_cache_fit_check_on_device_and_host():
    bpb = 1 << 15
    cfg = EngineConfig(num_blocks=100, device="cuda")  # the config itself needs no GPU
    cfg.check_cache_fits(100, bpb, device_free=100 * bpb, host_free=0)
    with pytest.raises(ValueError, match=r"num_blocks=100: .* cuda has"):
        cfg.check_cache_fits(100, bpb, device_free=100 * bpb - 1, host_free=0)
    cfg = EngineConfig(num_blocks=100, preemption_mode="swap")  # CPU: device + swap pool on the host
    cfg.check_cache_fits(100, bpb, host_free=200 * bpb)
    with pytest.raises(ValueError, match="num_blocks=100"):
        cfg.check_cache_fits(100, bpb, host_free=200 * bpb - 1)
    cfg = EngineConfig(num_blocks=10, num_cpu_blocks=1000, device="cuda")
    with pytest.raises(ValueError, match="num_cpu_blocks=1000"):
        cfg.check_cache_fits(10, bpb, device_free=10**12, host_free=100 * bpb)


@pytest.mark.parametrize("block_size", [3, 12, 512])
def test_triton_block_size_rejected_at_construction(block_size):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(block_size=block_size, attention_backend="triton")
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=block_size, attention_backend="triton")
    EngineConfig(block_size=block_size, attention_backend="torch")  # the torch path takes any


def test_truncated_safetensors_is_one_sentence(tmp_path):
    from minipaged.model.loader import COURSE_MODEL_DIR

    ckpt = tmp_path / "ckpt"
    shutil.copytree(COURSE_MODEL_DIR, ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors could not be read"):
        LLM(model=str(ckpt))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_sentence():
    with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available on this machine"):
        LLM(device="cuda")


# ------------------------------------------------------------ generate
@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(block_size=4, num_blocks=32, max_num_seqs=8)


@pytest.mark.parametrize(
    "params, name",
    [
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(n=10**6), r"n=1000000 exceeds max_num_seqs=8"),
        (SamplingParams(n=9), "max_num_seqs"),
        (SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_generate_rejects_params_the_engine_cannot_serve(llm, params, name):
    with pytest.raises(ValueError, match=name):
        llm.generate(["Once upon a time", "The sun"], [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    with pytest.raises(ValueError, match=name):  # the engine's own entry point too
        llm.llm_engine.add_request("x", "The sun", params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_strings_need_a_tokenizer():
    from minipaged.sampling_params import verify_sampling_params

    p = SamplingParams(stop=["x"])
    verify_sampling_params(p, 10, 4)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        verify_sampling_params(p, 10, 4, has_tokenizer=False)


@pytest.mark.parametrize("prompts", [[True, False], [[True, 5]], [[5, False]]])
def test_bools_are_not_token_ids(llm, prompts):
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)


def test_stop_string_from_the_table(llm):
    """``SamplingParams(stop=[" a"])``: generation ends at the first " a", which is cut."""
    p = SamplingParams(temperature=0.0, max_tokens=12)
    base = llm.generate("Once upon a time", p, use_tqdm=False)[0].outputs[0]
    assert " a" in base.text  # ", there was a kind little boy ..."
    c = llm.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, stop=[" a"]), use_tqdm=False
    )[0].outputs[0]
    assert c.text == base.text[: base.text.index(" a")]
    assert c.finish_reason == "stop" and c.stop_reason == " a"
    assert base.token_ids[: len(c.token_ids)] == c.token_ids


# ------------------------------------------------------------ the CLI
@pytest.mark.parametrize(
    "argv",
    [
        ["memory", "--num-requests", "0"],
        ["memory", "--block-size", "-4"],
        ["memory", "--num-slots", "nan"],
        ["memory", "--max-model-len", "x"],
        ["sharing", "--num-requests", "-1"],
        ["sharing", "--block-size", "0"],
        ["sharing", "--concentration", "nan"],
        ["sharing", "--concentration", "-1"],
        ["simulate", "--jobs", "0"],
        ["simulate", "--num-requests", "0"],
        ["simulate", "--threshold", "0"],
        ["simulate", "--threshold", "inf"],
        ["simulate", "--factor", "nan"],
        ["simulate", "--factor", "1"],
        ["simulate", "--block-sizes", "16,0"],
        ["simulate", "--block-sizes", "16,x"],
        ["bench", "--num-requests", "0"],
        ["bench", "--threads", "-1"],
        ["bench", "--block-size", "0"],
        ["bench", "--num-blocks", "-5"],
        ["bench", "--max-num-seqs", "0"],
        ["bench", "--max-num-batched-tokens", "nan"],
        ["bench", "--repeats", "0"],
        ["demo", "--threads", "-2"],
        ["demo", "--steps", "-1"],
    ],
)
def test_numeric_cli_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}" in err and "Traceback" not in err


def test_a_value_error_from_a_command_is_exit_2(capsys):
    assert main(["bench", "--quick", "--systems", "x"]) == 2
    assert "minipaged bench: error: systems" in capsys.readouterr().err


def _strict(text: str):
    def bad(c):
        raise AssertionError(f"non-strict JSON constant {c}")

    return json.loads(text, parse_constant=bad)


def test_json_output_is_strict(capsys):
    assert dumps_json({"a": [math.inf, -math.inf, math.nan, 1.5]}) == '{"a": [null, null, null, 1.5]}'
    # a threshold below every latency: no policy sustains any rate, the ratios are undefined
    argv = [
        "simulate",
        "--quick",
        "--json",
        "--no-figures",
        "--workload",
        "sharegpt",
        "--num-requests",
        "10",
        "--block-sizes",
        "none",
        "--jobs",
        "1",
        "--threshold",
        "1e-9",
    ]
    assert main(argv) == 0
    report = _strict(capsys.readouterr().out)
    assert report["headline"]["sharegpt"]["paged/orca-oracle"] is None
    assert main(argv[:2] + argv[3:]) == 0  # the text report: no "infx"
    assert "infx" not in capsys.readouterr().out
    assert main(["memory", "--json", "--no-figure", "--num-requests", "5"]) == 0
    _strict(capsys.readouterr().out)
    assert main(["sharing", "--json", "--num-requests", "3"]) == 0
    _strict(capsys.readouterr().out)
