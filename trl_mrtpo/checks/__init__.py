"""What is checked about a user's inputs and extensions, in one room: the configuration, datasets, rewards and
rollouts (:mod:`.validation`), the guard layer around rules, terms and providers (:mod:`.guards`) and each batch's
finiteness (:mod:`.finite_credit`)."""
