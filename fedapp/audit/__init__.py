"""The privacy audit's mechanism: what every attack on every method shares.

- membership.py: a membership attack's figures from its scores (ROC AUC, TPR at a low FPR, the best balanced
  accuracy) and their bootstrap intervals;
- scores.py: membership scores of a candidate image: a denoiser's loss, a classifier's loss, a likelihood
  ratio against shadow models, the distance to the nearest generated image; the memorisation check;
- reconstruction.py: how close generated or inverted images come to the members against the non-members, and
  the share of near-copies under a threshold set on the non-members.

Who holds what and how a method's upload becomes a model or images is the audit's orchestration
(experiments/privacy_audit.py), a layer above the runs: it reads what a run kept (fedapp/server/uploads.py,
the final model) and scores it here. PFDM's in-run attacks (strategies/pfdm_attacks.py) use the same scores.
"""
