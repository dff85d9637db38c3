"""Compiler passes, one per file. Their order is written once, in graphc/compiler.py."""
