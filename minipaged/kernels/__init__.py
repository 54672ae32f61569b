"""minipaged.kernels"""
