"""magicube.train"""
