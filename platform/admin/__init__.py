"""loramux.platform.admin"""
