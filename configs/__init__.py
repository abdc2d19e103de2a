"""The YAML experiment configs, installed as package data."""
