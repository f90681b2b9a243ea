"""minisgl.checkpoint: reading checkpoints into a model's parameters. Where each tensor goes
(`weights`: `WeightSlot`s, safetensors loading, sharding as tensors load), GGUF files (`gguf_convert`:
the small directory derived once, config and tokenizer; `gguf_weights`: the tensors in place over
the file's map; `gguf_moe`: llama.cpp's mixture-of-experts names and fields) and fp8 checkpoints
(`fp8`: the published schemes, their scales, `--quantization fp8`)."""
