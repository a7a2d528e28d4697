"""smf: the Sparse Memory Finetuning experiment suite built on smf_kernels.

Subpackages: ``smf.model`` (memories in Qwen-2, freezing, adapters), ``smf.data`` (loaders,
formatting, tokenisation) and ``smf.tiny`` (a CPU-sized preset of model and tokenizer).
"""
