"""Feedback that never shows hidden-test code (nbgrader_config.py puts this preprocessor in
`nbgrader generate_feedback`): in every test cell the hidden region is dropped and an error's
traceback, which quotes the failing lines, becomes the one-line reason `zero-lab grade` gives."""

from nbgrader.preprocessors import NbGraderPreprocessor

from zero_lab.course_tools.build import HIDDEN_MARKERS
from zero_lab.course_tools.grading import reason


def without_hidden_region(source: str) -> str:
    kept, inside = [], False
    for line in source.splitlines():
        if HIDDEN_MARKERS[0] in line:
            inside = True
            kept.append("# (hidden tests)")
        elif HIDDEN_MARKERS[1] in line:
            inside = False
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


class HideHiddenTests(NbGraderPreprocessor):
    def preprocess_cell(self, cell, resources, index):
        grading = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and grading.get("grade"):
            cell.source = without_hidden_region(cell.source)
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{reason(output, 0, 1)}"]
        return cell, resources
