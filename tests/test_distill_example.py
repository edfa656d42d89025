"""examples/loopfm-distill.yaml, checked without running it."""

from pathlib import Path

import yaml

from gem.api import parse_object
from gem.train.tracking import registered_model_name

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_example_student_does_not_register_as_a_version_of_its_teacher():
    """Both examples log to one experiment; registered under the same name, the student would become
    the newest version of the teacher's registered model (models:/<name>/latest a student, which a
    later distillation naming that URI as its teacher refuses)."""
    teacher = parse_object(yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text()))
    student = parse_object(yaml.safe_load((EXAMPLES / "loopfm-distill.yaml").read_text()))
    assert student.spec.teacher.gem_training == teacher.metadata.name
    assert teacher.spec.mlflow.register_model and student.spec.mlflow.register_model
    assert registered_model_name(student) != registered_model_name(teacher)
