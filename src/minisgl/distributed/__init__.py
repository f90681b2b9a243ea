"""minisgl.distributed"""
