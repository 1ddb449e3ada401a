"""Starting ranks and watching them: launch, forked, cluster, failures, restart, magic, notebook."""
