"""minipaged.engine"""
