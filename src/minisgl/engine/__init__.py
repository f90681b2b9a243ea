"""minisgl.engine"""
