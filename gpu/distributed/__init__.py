"""The process group of a worker gang and the collectives the layers call (DESIGN.md section 10): group.py (the
group, its rendezvous, `current()` for the layers) over store.py (the rendezvous's store across nodes: its listening
socket, the collectives' interface, the sealing of its values). It imports torch and the standard library only,
nothing else of ours; gpu/layers, gpu/models, the runner and the gang (actors/engine/gang.py) import it."""
