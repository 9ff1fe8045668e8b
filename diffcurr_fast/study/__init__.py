"""Reproduction studies: ablation arms over seeds, each an ordinary run, with a report of error bars and plots."""

from diffcurr_fast.study.spec import Arm, StudySpec, load_spec, spec_from_dict

__all__ = ["Arm", "StudySpec", "load_spec", "spec_from_dict"]
