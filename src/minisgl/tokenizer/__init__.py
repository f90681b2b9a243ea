"""minisgl.tokenizer"""
