"""magicube.model"""
