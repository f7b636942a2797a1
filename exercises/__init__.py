"""Your code for the course: one file per chapter, each function a stub to fill in.

Every stub states its contract in the docstring. Check your work from the chapter's notebook
with `minfer.lab.course.check("chNN")`, or from a shell with
`pytest tests/exercises/test_chNN_*.py --impl exercises`.
"""
