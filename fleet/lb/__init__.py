"""Load balancers in front of the fleet: HAProxy's runtime API, its configuration, and traffic in and out."""
