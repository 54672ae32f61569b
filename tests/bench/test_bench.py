"""``minipaged bench`` (minipaged/bench/serving.py) and its transformers baselines
(minipaged/bench/hf_baselines.py): quick runs on a tiny random Llama, structure and invariants.

No timed assertions: wall-clock numbers vary; token counts, step counts and outputs do not.
The outputs of the four systems are compared with each other and, for one request, with
transformers' ``generate`` on that request alone (the independent reference).
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.bench import hf_baselines
from minipaged.bench.hf_baselines import static_batches
from minipaged.bench.serving import format_report, run_benchmark, scaled_workload, workload_prompts
from minipaged.cli import main

QUICK = dict(model="tiny-llama", num_requests=8, workload_max_len=128, warmup=False)


def test_scaled_workload_fits_the_context():
    lengths = scaled_workload("sharegpt", 200, 0, 512)
    assert lengths == scaled_workload("sharegpt", 200, 0, 512)  # seeded
    assert all(p >= 1 and o >= 1 and p + o <= 512 for p, o in lengths)
    mean_out = sum(o for _, o in lengths) / len(lengths)
    assert 50 < mean_out < 110  # ShareGPT's 338 scaled by 512 / 2048, clipped


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=30),
    slots=st.integers(80, 300),
    max_seqs=st.integers(1, 8),
)
def test_static_batches_fit_and_are_greedy(lengths, slots, max_seqs):
    def cost(batch):  # a left-padded batch keeps max prompt + max new - 1 tokens per row
        return len(batch) * (max(lengths[i][0] for i in batch) + max(lengths[i][1] for i in batch) - 1)

    batches = static_batches(lengths, slots, max_seqs)
    assert [i for b in batches for i in b] == list(range(len(lengths)))  # arrival order, each once
    for k, b in enumerate(batches):
        assert cost(b) <= slots and len(b) <= max_seqs
        if k + 1 < len(batches):  # greedy: the next request would not have fitted
            grown = b + [batches[k + 1][0]]
            assert cost(grown) > slots or len(grown) > max_seqs


def test_static_batches_refuse_a_request_larger_than_the_slots():
    with pytest.raises(ValueError, match="kv_token_slots"):
        static_batches([(10, 5), (60, 50)], 100, 4)


@pytest.fixture(scope="module")
def quick_report():
    return run_benchmark(**QUICK, profile=True, profile_steps=2)


def test_quick_run_all_four_systems(quick_report):
    r = quick_report
    lengths = scaled_workload("sharegpt", 8, 0, 128)
    want = sum(o for _, o in lengths)
    slots = r["kv_cache"]["num_blocks"] * r["kv_cache"]["block_size"]
    assert r["kv_cache"]["token_slots"] == slots and r["model"] == "tiny-llama"
    assert [m["label"] for m in r["systems"].values()] == ["a", "b", "c", "d"]
    for name, m in r["systems"].items():
        if "unavailable" in m:
            assert name == "hf-continuous-batching", f"{name}: {m['unavailable']}"
            continue
        assert m["output_tokens"] == want, name
        assert m["tokens_per_s"] > 0 and m["wall_s"] > 0 and m["steps"] > 0, name
        assert 0 <= m["ttft_s_mean"] <= m["latency_s_mean"] <= m["wall_s"] + 1e-6, name
        assert m["tpot_ms_mean"] is None or m["tpot_ms_mean"] >= 0, name
    a, b, c = (r["systems"][n] for n in ("continuous+paged", "static+contiguous", "hf-generate-static"))
    assert r["outputs_equal"]["a=b"] and r["outputs_equal"]["a=c"] and r["outputs_equal"]["b=c"]
    assert r["outputs_matching"]["a=c"] == "8/8"
    assert a["steps"] <= b["steps"] and a["refused"] == b["refused"] == 0
    assert set(a["step_time_split"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert 0 <= a["overhead_fraction"] < 1 and a["overhead_ms_per_step"] >= 0
    # (c): padded batches never hold more than the pool's token slots, and cover every request
    assert c["kv_token_slots_peak"] <= slots and sum(c["batch_sizes"]) == 8
    batches = static_batches(lengths, slots, r["max_num_seqs"])
    assert c["batch_sizes"] == [len(b) for b in batches]
    assert c["steps"] == sum(
        max(lengths[i][1] for i in b) for b in batches
    )  # every row runs to the batch's max
    d = r["systems"]["hf-continuous-batching"]
    if "unavailable" not in d:
        assert d["kv_token_slots"] >= slots  # transformers rounds up to whole sectors, never down
        assert r["outputs_matching"]["a=d"].endswith("/8")
    assert r["ratios"]["a/b"] == round(a["tokens_per_s"] / b["tokens_per_s"], 2)
    assert r["step_ratios"]["a/b"] == round(b["steps"] / a["steps"], 2)
    p = r["profile"]
    assert p["running_seqs"] == 64 and p["step_ms"] > 0
    assert 0 < p["sched_block_prepare_fraction"] <= p["non_model_fraction"] < 1
    assert "execute_model" in p["cprofile_fraction"] and 0 <= p["cprofile_block_management_fraction"] < 1
    from minipaged.kernels.selector import get_attn_backend

    assert r["attention_backend"] == p["attention_backend"] == get_attn_backend("auto", "cpu")
    # the step's forward split for the backend that ran, and for the torch reference beside it
    assert set(p["forward_breakdowns"]) == {r["attention_backend"], "torch"}
    for b in p["forward_breakdowns"].values():
        assert b["num_seqs"] == 64 and b["forward_ms"] > 0 and b["floor_ms"] > 0
    f = r["matmul_floor"]  # the runs' weight matmuls alone, on one cost curve
    assert f["seconds"]["a"] > 0 and f["seconds"]["b"] > 0
    assert f["a/b"] == pytest.approx(f["seconds"]["b"] / f["seconds"]["a"], abs=0.01)
    text = format_report(r)
    assert "(a)continuous+paged" in text and "a/c" in text and "profile:" in text
    assert "weight matmuls alone over each run's steps" in text


def test_request_equals_transformers_generate_alone(tmp_path):
    """The independent reference: request 0 of the workload served alone by transformers, unpadded;
    minipaged (alone) and the padded static batch of (c) give the same tokens."""
    import torch

    from minipaged import LLM, SamplingParams

    path = hf_baselines.make_random_llama("tiny-llama", str(tmp_path / "m"), seed=0)
    hf = hf_baselines.load_hf_model(path)
    lengths, prompts = workload_prompts("sharegpt", 8, 0, 128, vocab=256)
    o = lengths[0][1]
    hf.generation_config.eos_token_id = None  # NOTE: as ignore_eos: exactly max_new_tokens tokens
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=o, do_sample=False, pad_token_id=2)[
            0, len(prompts[0]) :
        ].tolist()
    assert len(ref) == o
    res = hf_baselines.hf_generate_static(hf, prompts[:3], [k for _, k in lengths[:3]], 10_000, 3)
    assert len(res.token_ids[0]) == o and res.token_ids[0] == ref  # padded with its batch-mates
    out = LLM(model=path, num_blocks=64).generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == ref


def test_unavailable_system_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no paged attention here")

    monkeypatch.setattr(hf_baselines, "hf_continuous_batching", broken)
    r = run_benchmark(**QUICK, systems="a,d")
    assert r["systems"]["hf-continuous-batching"]["unavailable"] == "RuntimeError: no paged attention here"
    assert "unavailable: RuntimeError" in format_report(r)
    assert r["outputs_equal"] == {} and r["ratios"] == {}


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_requests"):
        run_benchmark(num_requests=0)
    with pytest.raises(ValueError, match="systems"):
        run_benchmark(systems="a,x")
    with pytest.raises(ValueError, match="repeats"):
        run_benchmark(repeats=0)
    with pytest.raises(ValueError, match="threads"):
        run_benchmark(threads=-1)


def test_cli_json_quick(capsys):
    assert main(["bench", "--model", "tiny-llama", "--quick", "--systems", "a,b", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["num_requests"] == 8 and r["workload"]["max_model_len"] == 128
    assert r["outputs_equal"] == {"a=b": True} and "a/b" in r["ratios"]


def test_cli_saves_the_profile_and_its_figure(tmp_path, capsys):
    out = tmp_path / "profile.json"
    fig = tmp_path / "breakdown.png"
    argv = ["bench", "--model", "tiny-llama", "--quick", "--systems", "a", "--profile"]
    assert main(argv + ["--save-profile", str(out), "--profile-figure", str(fig)]) == 0
    saved = json.loads(out.read_text())
    assert (
        saved["command"].startswith("minipaged bench --model tiny-llama")
        and "--save-profile" in saved["command"]
    )
    assert len(saved["runs"]) in (1, 2) and all(b["num_seqs"] == 64 for b in saved["runs"].values())
    assert "serving" not in saved  # only (a) ran: no a/b floor to record
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_floors_share_one_curve():
    """Two runs on one curve: the same steps twice cost exactly twice; an empty step costs nothing."""
    from minipaged.bench.serving import matmul_floors
    from minipaged.model import load_model

    model = load_model(None)[0]
    steps = [(1, 1), (4, 4), (17, 3), (40, 2)]
    f = matmul_floors(model, {"once": steps, "twice": steps * 2, "idle": [(0, 0)]}, repeats=1)
    assert f["once"] > 0 and f["twice"] == pytest.approx(2 * f["once"]) and f["idle"] == 0


def test_step_cost_split_recovers_a_hand_made_example():
    """Two runs built from 2 ms per step and 0.5 ms per sequence-step beyond 1 s of matmuls each:
    the split gives those back, and what they mean for a/b."""
    from minipaged.bench.serving import step_cost_split

    floors, steps, seq_steps = {"a": 1.0, "b": 1.0}, {"a": 100, "b": 300}, {"a": 1000, "b": 1000}
    walls = {k: floors[k] + steps[k] * 0.002 + seq_steps[k] * 0.0005 for k in floors}  # a 1.7 s, b 2.1 s
    split = step_cost_split(floors, walls, steps, seq_steps)
    assert split["per_step_ms"] == pytest.approx(2.0) and split["per_seq_step_ms"] == pytest.approx(0.5)
    assert split["a/b_if_free_per_seq"] == pytest.approx(round(1.6 / 1.2, 2))
    assert split["per_step_ms_for_2x"] == pytest.approx(10.0)  # (2 * 1 - 1) s / (300 - 2 * 100) steps
    assert step_cost_split(floors, {"a": 0.5, "b": 0.5}, steps, seq_steps) is None  # faster than the floor
