"""minipaged.model"""
