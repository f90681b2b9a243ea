"""minisgl.scheduler"""
