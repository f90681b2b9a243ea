"""minisgl.benchmark"""
