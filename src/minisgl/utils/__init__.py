"""minisgl.utils"""
