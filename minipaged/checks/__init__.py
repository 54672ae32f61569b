"""minipaged.checks"""
