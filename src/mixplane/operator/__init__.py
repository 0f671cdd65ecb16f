"""The DataMixture Kubernetes operator: the CRD, the level-triggered controller, admission and scaling."""
