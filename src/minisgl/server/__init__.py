"""minisgl.server"""
