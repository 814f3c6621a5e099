"""loramux.platform.adapter_api"""
