"""minisgl.layers"""
