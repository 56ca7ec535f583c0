"""selftune on a Ray cluster: one whole engine per Ray Serve replica, sized by a cluster policy."""
