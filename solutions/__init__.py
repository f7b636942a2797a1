"""Worked versions of the exercises, one file per chapter, with the same functions and contracts.

Look here after you have tried. The notebooks run against these when MINFER_IMPL=solutions.
"""
