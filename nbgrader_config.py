"""nbgrader settings for zero-lab (the instructor flow and `zero-lab build` / `zero-lab grade`).

The course root is the folder holding this file: `zero-lab` copies it into a temporary
course to build and grade, so the same settings apply there with that folder as root.
"""

import os
import sys

from nbgrader.converters import GenerateAssignment

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)

root = os.path.dirname(os.path.abspath(__file__))
c.CourseDirectory.root = root
c.CourseDirectory.course_id = "zero-lab"
# Source notebooks (with reference solutions) and the learner edition generated from them.
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"
# The gradebook defaults to <root>/gradebook.db: gitignored in the repo, and builds and
# self-grading get their own under their temporary root.
# The exchange (release_assignment, collect, release_feedback) lives inside the course, not
# machine-wide; point it at a shared folder for a multi-user JupyterHub.
c.Exchange.root = os.path.join(root, "exchange")
os.makedirs(c.Exchange.root, exist_ok=True)  # nbgrader expects it to exist

# The learner edition's Run All runs to the end (zero-lab build writes course/ the same way).
c.GenerateAssignment.preprocessors = [*GenerateAssignment.class_traits()["preprocessors"].default(),
                                      "zero_lab.course_tools.build.LearnerEdition"]
# Feedback shows each test's points and why points were lost, never hidden-test code.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "zero_lab.course_tools.feedback.HideHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]

# Test cells start several ranks; a deadlocking answer is stopped by the launcher's own
# timeout (<= 30 s per test cell), this is the backstop for anything that blocks the kernel.
c.Execute.timeout = 300
c.Execute.startup_timeout = 120

# Learner code runs with the grader's rights: confine what it can (zero_lab/course_tools/sandbox.py).
if sys.argv[1:2] == ["autograde"]:
    from zero_lab.course_tools import sandbox
    from zero_lab.course_tools.kernel_sockets import use_unix_sockets

    sandbox.confine(root)
    use_unix_sockets(c, os.environ["JUPYTER_RUNTIME_DIR"])  # sandbox.py made that folder short and removes it
