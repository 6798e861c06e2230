"""The course's machinery, apart from what a lesson imports: running notebooks headless
(:mod:`.runner`), the results page (:mod:`.report`, :mod:`.claims`), student versions
(:mod:`.student`) and grading (:mod:`.grading`, with the pytest plugin its kernels load,
:mod:`.grading_plugin`). ``python -m utils`` is their command line; none of them imports
PyTorch, and the grader's sandbox gets the library a notebook needs, not this package.
"""
