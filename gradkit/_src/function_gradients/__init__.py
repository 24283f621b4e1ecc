"""Function-level gradients: gk.custom_gradient and gk.custom_jvp."""
