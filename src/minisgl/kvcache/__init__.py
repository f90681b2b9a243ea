"""minisgl.kvcache"""
