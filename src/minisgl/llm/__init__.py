"""minisgl.llm"""
