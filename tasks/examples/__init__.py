"""Examples that run as they are: ``tasks.examples.service``, a web service in front of the fleet
(the ``service`` extra). Nothing in the package imports them."""
