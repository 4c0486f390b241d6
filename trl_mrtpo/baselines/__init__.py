"""The other methods a comparison needs besides the research room's credit rules: OPSD on TRL's ``SDFTTrainer``
(:mod:`.opsd`) and INTUITOR's self-certainty reward (:mod:`.self_certainty`)."""
