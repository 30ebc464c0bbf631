"""The forward-pass lifecycle, from a bundle on disk to the pass an engine serves.

bundle (what a bundle on disk is: files, manifest, recipe, KV-cache tag) -> importer (the one
importer: own package per load; patch_guard captures what a candidate could patch first) ->
smoke (a candidate beside the incumbent on a private paged_driver cache), deadline,
weights_guard -> swap (ForwardPassManager: prepare off the serving path, install between
steps, history, rollback) -> identity (ActiveForwardPass, kept by the engine). recipes: named
knob sets of the stock pass.
"""
