"""The swarm: hivemind DHT at the edge, DHT records, and our fragment-exchange protocol on libp2p."""
