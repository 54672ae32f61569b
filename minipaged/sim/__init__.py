"""minipaged.sim"""
