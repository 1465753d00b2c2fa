"""Domain services `hearth serve` and the admin CLI share: the model catalog, the settings cache, request records.

They sit below the gateway and raise domain errors only; app.gateway.routing maps those to HTTP.
"""
