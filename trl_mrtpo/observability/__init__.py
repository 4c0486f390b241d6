"""Looking at where credit lands, around the trainer's logged metrics (:mod:`trl_mrtpo.diagnostics`): token-credit
heatmaps and curves (:mod:`.viz`) and the callback that plots them during training (:mod:`.callbacks`)."""
