"""The tree-build sidecar: ddtree.v1.TreeBuilder (Build / Accept) over ddtree.tree and the transport."""
