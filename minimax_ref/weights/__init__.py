"""Weights: the NVFP4 / MXFP8 codecs (`quant`), packed weights decoded at use (`packed`), reading checkpoints
(`checkpoint`), building a loaded model (`loader`), offloading (`offload`, with its `device_map`), synthetic
checkpoints on disk (`synth`, with its test tokenizer `synth_tokenizer`) and in memory (`synthetic`), expert pruning
(`prune`) and the embedded default checkpoint (`embedded`)."""
