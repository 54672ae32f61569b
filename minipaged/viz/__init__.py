"""minipaged.viz"""
