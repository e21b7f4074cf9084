"""nbgrader settings for zero-lab (the instructor flow and `zero-lab build` / `zero-lab grade`).

The course root is the folder holding this file: `zero-lab` copies it into a temporary
course to build and grade, so the same settings apply there with that folder as root.
"""

import os

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)

c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.course_id = "zero-lab"
# Source notebooks (with reference solutions) and the learner edition generated from them.
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"
# The gradebook defaults to <root>/gradebook.db: gitignored in the repo, and builds and
# self-grading get their own under their temporary root.

# Test cells start several ranks; a deadlocking answer is stopped by the launcher's own
# timeout (<= 30 s per test cell), this is the backstop for anything that blocks the kernel.
c.Execute.timeout = 300
c.Execute.startup_timeout = 120
