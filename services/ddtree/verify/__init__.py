"""The verify service: target model + decode engine behind ddtree.v1.Generation (`ddtree serve verify`)."""
