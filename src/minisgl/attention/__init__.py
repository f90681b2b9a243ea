"""minisgl.attention"""
