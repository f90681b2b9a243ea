"""minisgl.models"""
