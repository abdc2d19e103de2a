"""magicube.eval"""
