"""loramux.platform.openai"""
