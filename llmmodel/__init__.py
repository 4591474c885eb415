"""LLMModel (docs: LLMModel): a team declares a model, its GPU memory and its SLA; the planner
sizes its vLLM pools, ``onboard`` writes the routing YAML and the Kubernetes objects, ``up
--models`` serves it on simulated pods and ``operator`` applies it in a cluster."""
