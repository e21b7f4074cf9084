"""Demo cells that use a learner's unfinished exercise end with one line, not a traceback.

    with needs_exercises():                  # a cell's body
        ...
    result = skip_unfinished(fn, *args)      # fn's result, or None after the line

"Unfinished" is a NotImplementedError, raised here or in a rank (zero_lab.RankFailed saying so):
every other error goes through, so a bug in written code still shows its traceback.
"""

from __future__ import annotations

from contextlib import contextmanager

from zero_lab.launcher import RankFailed

SKIPPED = "Skipped: this cell uses an exercise you have not written yet."


@contextmanager
def needs_exercises(quiet: bool = False, missing_names: bool = False):
    """Run the block; an unfinished exercise prints SKIPPED (unless quiet) and ends it. With missing_names,
    a NameError ends it too: a name that a cell skipped above would have defined."""
    try:
        yield
    except (NotImplementedError, RankFailed, NameError) as error:
        if isinstance(error, NameError):
            if not missing_names:
                raise
            print(f"Skipped: this cell needs {error.name!r}, which a skipped cell above did not make yet.")
        elif isinstance(error, RankFailed) and "NotImplementedError" not in str(error):
            raise
        elif not quiet:
            print(SKIPPED)


def skip_unfinished(fn, *args, quiet: bool = False, **kwargs):
    """fn(*args, **kwargs), or None when it needs an unfinished exercise (after SKIPPED, unless quiet)."""
    with needs_exercises(quiet=quiet):
        return fn(*args, **kwargs)
    return None
